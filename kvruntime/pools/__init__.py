"""The staging pools requests go through when they do not move directly: their units,
their device copies and the bounce ring."""
