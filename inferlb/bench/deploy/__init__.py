"""The fleet changing under load (issue 15): ``inferlb bench rollout`` (a canary's split, blue-green
switches and rollbacks) and ``autoscale`` (the elastic pool through a load step)."""
