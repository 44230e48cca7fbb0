"""Chapter 05's graded exercises."""

EXERCISES = []
