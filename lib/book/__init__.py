"""What only the chapters use: sliders over plots (`widgets`), numbers in prose (`prose`), the
chapters' experiments (`studies`) and the coding exercises' solutions and checks (`exercises`)."""
