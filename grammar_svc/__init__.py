"""structd grammar service: compiles constraints and streams token masks."""
