"""Chapter 07's graded exercises."""

EXERCISES = []
