"""Chapter 04's graded exercises."""

EXERCISES = []
