"""What a run leaves to look at: the step trace (trace.py) and the dashboard's live feed (live.py)."""
