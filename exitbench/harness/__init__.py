"""The lm-eval side: the `exitbench` model, its command line, tasks and their documents."""
