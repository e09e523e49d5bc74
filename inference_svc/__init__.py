"""structd inference service (continuous batching engine; see issue 3)."""
