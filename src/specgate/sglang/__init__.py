"""The load gate inside SGLang: the plugin, the true-off hooks, aux-state buffers, the TP log check."""
