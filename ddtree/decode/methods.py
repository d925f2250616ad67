"""The decoding methods, in a module without torch: the command line checks --method before it
imports torch (a mistake costs well under a second)."""

METHODS: tuple[str, ...] = ("ar", "dflash", "ddtree")
