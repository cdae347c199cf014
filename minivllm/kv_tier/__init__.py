"""A second tier for the prefix cache: evicted K/V blocks kept in RAM and on disk (store.py), plugged
into the block manager and the step by extension.py."""
