"""Chapter 08's graded exercises."""

EXERCISES = []
