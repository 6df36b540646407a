"""The report, its cost model and plots, provenance, and the experiment archive."""
