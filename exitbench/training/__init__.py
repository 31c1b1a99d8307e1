"""Training the embedded models: one loop (train.py), a recipe per family (raven.py, gpt2.py, ouro.py) over
the knobs of settings.py, the synthetic task, the natural-text corpus, Ouro's gate objectives."""
