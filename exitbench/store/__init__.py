"""Result cells on disk: what a cell is, its schema, the directory that holds them, content identity."""
