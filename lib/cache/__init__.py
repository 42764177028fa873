"""Storage: where K and V live between steps. The contiguous cache (`kv_cache`), its number
formats (`quant`), KIVI's mixed store (`kivi`, `kivi_parts`) and paged blocks (`blocks` keeps the
books, `paged` the tensors; `lib.fast.paged_kernel` reads them).
This floor knows nothing of the model: it imports only `lib.config` and `lib.checks`."""
