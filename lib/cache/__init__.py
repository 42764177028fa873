"""Storage: where K and V live between steps. The contiguous cache (`kv_cache`), its number
formats (`quant`), KIVI's mixed store (`kivi`), paged blocks (`blocks` keeps the books, `paged`
the tensors, `paged_kernel` reads them) and the memory formula on real models (`memory`).
This floor knows nothing of the model: it imports only `lib.config` and `lib.checks`."""
