"""A GPU, priced from its data sheet: real models' K/V bytes from their Hugging Face configs
(`memory`, with the configs in `models`), the GPU record, the book's one step-time formula and
its clock (`step`), and the published measurements it is checked against (`published`). The book
runs nothing here; its chapters use it to carry this CPU's lessons to an H100."""
