"""The pure protocol core: records, keys, rules and codecs. No I/O, threads or clock reads."""
