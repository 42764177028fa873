"""What only the chapters use: sliders over plots (`widgets`) and numbers in prose (`prose`)."""
