"""Measurements beside the sweep: calibration, the learned exit's fit, geometry, depth, traces."""
