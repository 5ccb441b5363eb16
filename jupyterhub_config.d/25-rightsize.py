# Right-sizing: whether the slices people use are bigger or smaller than they need,
# from the GPU memory the slice service measured over each session. The per-group keys
# of issue 23 (default_offer, purpose_*) are in 20-groups.py; reference:
# docs/policies.md ("Starts without options", "Purpose"), docs/analyst-guide.md
# ("Right-sizing").

c = get_config()  # noqa: F821  (provided by the config loader)

# Right-sizing: the thresholds of the spawn form's hint ("your last sessions on medium
# peaked at 9 GiB: small would do") and of `mig-spawner report --rightsize`. The
# defaults, shown here, are documented in docs/analyst-guide.md.
# c.RightsizeConfig.min_sessions = 3   # measured sessions on a size before any verdict
# c.RightsizeConfig.min_samples = 5    # samples a session needs to count as measured
# c.RightsizeConfig.recent = 5         # latest measured sessions judged
# c.RightsizeConfig.fits_below = 0.75  # over-sized: peaks below 75% of the next smaller size
# c.RightsizeConfig.full_above = 0.95  # under-sized: a peak at 95% of the slice's memory
# The slice service samples each held slice (memory, SM activity) this often:
# c.SliceServiceApp.usage_sample_interval = 60
