"""`structd bench e2e`: the end-to-end benchmark and its peers (run.py is the entry)."""
