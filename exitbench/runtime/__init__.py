"""What every command runs on: devices, ranks, safe files, provenance, progress, typed input."""
