"""Command-line jobs behind the nox sessions; each runs the same way here and on the GPU machine."""
