"""One module per command; each exposes register(app)."""
