"""What runs beside the library: the command line, the Prometheus exporter, the leak check, the
allocation plot, and dev helpers (random-weight demo models, progress bars)."""
