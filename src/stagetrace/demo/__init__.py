"""``stagetrace demo``: a real FastAPI inference service, traced, under load, with the verdicts summarised."""
