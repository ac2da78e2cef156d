"""Ray actors: thin shells over rayrl (Ray is imported here and in driver.py only)."""
