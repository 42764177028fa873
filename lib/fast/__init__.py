"""Fast paths: the same model, made fast on a CPU (llm.c keeps its fast kernels apart from the
clean reference in the same way). `lean` is the cached step in fewer numpy calls, `kernels` the
small-rows products it may choose, `batch` one step for many sequences over the paged pool, and
`paged_kernel` the compiled attention that reads the pool's blocks (and their quantized codes) in
place. Each is tested against `lib.model.forward`."""
