"""Reading sweeps: Pareto frontiers, the CI gate, the report page, exit maps, terminal tables."""
