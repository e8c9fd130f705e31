"""pytest plugin entry point (registered through ``pytest11``); inactive unless a test uses it."""
