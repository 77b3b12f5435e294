"""Maze navigation as RL.

* `env`: randomized Prim's mazes, BFS shortest paths, the step rule and reward;
* `policy`: the autoregressive transformer policy (`MazePolicy`);
* `task`: warm start, then SERA / uniform MaxRL / GRPO (`MazeTask`), pass@k.
"""
