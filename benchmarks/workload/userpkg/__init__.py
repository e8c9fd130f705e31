"""The user's own (uninstalled) code: a training loop that spends its time inside minitorch."""
