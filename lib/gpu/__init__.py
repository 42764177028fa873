"""A GPU, priced from its data sheet: real models' K/V bytes from their Hugging Face configs
(`memory`, with the configs in `models`), the GPU record and one decode step's time on it. The
book runs nothing here; chapters 4, 5, 8, 10 and 11 use it to carry this CPU's lessons to an H100."""
