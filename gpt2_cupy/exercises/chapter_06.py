"""Chapter 06's graded exercises."""

EXERCISES = []
