"""Training the embedded models: the loop, the synthetic task, the natural-text corpus."""
