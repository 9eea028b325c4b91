"""Built-in trackers. Each is a hook plugin implementing ``miles_on_metrics``, registered
for the duration of a run by the driver; third-party trackers use the same hook."""
