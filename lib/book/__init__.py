"""What only the chapters use: sliders over plots (`widgets`), numbers in prose (`prose`) and the
coding exercises' solutions and checks (`exercises`)."""
