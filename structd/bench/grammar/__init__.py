"""`structd bench grammar`: the grammar service benchmark (run.py is the entry)."""
