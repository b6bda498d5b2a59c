"""When to save and what to keep: schedules, retention, the adaptive interval and the run history."""
