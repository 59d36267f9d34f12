"""The command line: ``tokenpipe serve`` and the per-process commands. It sits above the
process packages it starts; nothing below imports it."""
