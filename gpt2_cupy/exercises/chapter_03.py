"""Chapter 03's graded exercises."""

EXERCISES = []
