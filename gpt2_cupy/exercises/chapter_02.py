"""Chapter 02's graded exercises."""

EXERCISES = []
