"""Chapter 01's graded exercises."""

EXERCISES = []
