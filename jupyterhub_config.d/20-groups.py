# Group policies for mig-spawner: who may have which MIG slice, how many, for how long.
#
# Copy this file into your hub's jupyterhub_config.d/ and edit it. The hub (spawner) and
# the slice service (culler) both read it, so the limits they apply always agree.
# Full reference: docs/policies.md. Mistakes (a misspelt key, a profile your GPUs do not
# have, "30x" as a duration) are all reported at once, each naming the group and the key.
#
# The three kinds of team below come from the usual advice for sharing a MIG GPU:
# notebooks want small slices and firm clean-up, inference wants mid-size slices that
# stay up longer, heavy experiments want big slices, few of them, and time to finish.

c = get_config()  # noqa: F821  (provided by the config loader)

# --- Slice classes: one name per *need*, one profile per GPU model ----------------------
# A class lets a group allow "small" instead of listing 1g.18gb (H200) and 1g.10gb (A100
# 80GB) separately; on a mixed fleet the user picks "small" and gets the right profile of
# whichever GPU has one free. Keys under "profiles" are GPU model keys: a100-40gb,
# a100-80gb, a30, h100, h100-nvl, gh200, h200, b200. Only the models you own are needed.
# Describe what each size is *for*: memory alone is a poor guide (a slice can hold a
# model yet lack the compute or bandwidth to serve it fast enough). The form, the slice
# map and the report show each slice's memory themselves, as GiB with one decimal
# ("32.2 GiB"); a size you write here is checked against it when the hub starts (a
# class spans GPU models of different sizes, so its wording had better not state one).
c.MIGPolicyConfig.slice_classes = {
    "small": {
        "display_name": "Small: 1 of 7 compute slices",
        "description": "Debugging, small notebooks, checking that a model loads and that "
        "the input pipeline is right.",
        "profiles": {
            "a100-40gb": "1g.5gb",
            "a100-80gb": "1g.10gb",
            "h100": "1g.10gb",
            "h200": "1g.18gb",
        },
    },
    "medium": {
        "display_name": "Medium: 2 of 7 compute slices",
        "description": "Inference of a mid-size model, notebooks with bigger batches. "
        "Check latency under parallel load before relying on it.",
        "profiles": {
            "a100-40gb": "2g.10gb",
            "a100-80gb": "2g.20gb",
            "h100": "2g.20gb",
            "h200": "2g.35gb",
        },
    },
    "large": {
        "display_name": "Large: 3 of 7 compute slices",
        "description": "Fine-tuning and heavy experiments. Measure peak memory in a short "
        "test run first: it grows with batch size and context length.",
        "profiles": {
            "a100-40gb": "3g.20gb",
            "a100-80gb": "3g.40gb",
            "h100": "3g.40gb",
            "h200": "3g.71gb",
        },
    },
    "full": {
        "display_name": "Whole GPU (one MIG instance)",
        "description": "Only for a job that really needs nearly all of the card's memory "
        "and compute; everyone else waits while it runs.",
        "profiles": {
            "a100-40gb": "7g.40gb",
            "a100-80gb": "7g.80gb",
            "h100": "7g.80gb",
            "h200": "7g.141gb",
        },
    },
}

# --- Offers: wording for profiles that groups list directly -----------------------------
# A group may also allow a concrete profile ("1g.35gb"); it then exists only on the GPUs
# that have it. Profiles listed in a group but not here are shown by their plain name.
c.MIGPolicyConfig.offers = {
    "1g.35gb": {
        "display_name": "Memory-heavy small (H200, 32.2 GiB, 1 compute slice)",
        "description": "A model that needs memory more than speed: embeddings, a "
        "quantised LLM for tests, batch scoring overnight.",
    },
}

# --- Group policies: one entry per JupyterHub group --------------------------------------
# Keys (all optional except "allowed"; the defaults are shown in docs/policies.md):
#   allowed               list of class names and/or profile names the group may pick
#   max_slices_per_user   how many slices (GPU servers) one member may hold at once
#   quota_slices          how many slices the whole group may hold at once (None: no cap)
#   quota_compute_slices  same, counted in compute slices (a 3g counts 3; None: no cap)
#   server_idle_timeout   stop a server with no activity for this long   ("30m", "1h30m").
#                         Activity is what people do (typing, running cells, saving,
#                         terminal input) and GPU work, not an open browser tab
#   server_idle_timeout_when_unwaited  a longer idle limit while nobody waits for the
#                         server's size (default: server_idle_timeout)
#   server_idle_timeout_when_waited    a shorter one while someone does, applied after
#                         a warning (default: server_idle_timeout)
#   open_tab_counts       True: an open tab's polling counts as activity, as with
#                         jupyterhub-idle-culler (default False)
#   kernel_idle_timeout   shut down a kernel idle for this long; the server keeps its slice
#   max_session_age       stop a server this long after it got its slice, busy or not
#   cull_busy_kernels     True: a kernel running with no output for kernel_idle_timeout
#                         counts as idle too. False (default): busy kernels are never
#                         ended by the idle limits, only by max_session_age
#   gpu_activity_counts   True (default): GPU work on the slice (processes with SM
#                         activity) counts as activity; held memory alone does not
#   warn_before           warn the user this long before a stop, with a "Keep my
#                         server" button (default "10m"; None: no warning); shorter
#                         than every limit above
#   extend_by             what Keep adds to max_session_age (default None: no extension)
#   max_extensions        how often Keep may extend one session (default 0)
#   priority              a member of several groups is charged to the group with the
#                         highest priority whose quota has room (ties: by group name)
#   default_offer         the size an admin's "Start Server"/"Start All" on /hub/admin or
#                         a REST spawn without options gets (one of "allowed"); without
#                         one such a start is refused, naming the missing choice
#   purpose_choices       what members pick from on the form's "What is this server
#                         for?" (shown on the slice map, by `mig-spawner status`, in the
#                         report; never a metrics label)
#   purpose_free_text     True (default): members may write their own (80 characters)
#   purpose_required      True: a spawn must say what the server is for (default False)
# Durations: "90s", "30m", "8h", "1d", "1h30m" or seconds; None, 0 or "never" = no limit.
c.MIGPolicyConfig.group_policies = {
    # Notebooks: small slices, one per person, firm clean-up so that a session left
    # open over the weekend does not hold a slice.
    "analysts": {
        "allowed": ["small", "medium"],
        "max_slices_per_user": 1,
        "quota_slices": 6,
        "server_idle_timeout": "30m",
        "server_idle_timeout_when_unwaited": "40m",
        "server_idle_timeout_when_waited": "25m",
        "kernel_idle_timeout": "15m",
        "max_session_age": "8h",
        "cull_busy_kernels": False,
        "purpose_choices": ["course exercises", "data exploration", "thesis"],
    },
    # Inference: mid-size slices that stay up through a day of load tests. The quota is
    # in compute slices, so two "large" (3+3) or three "medium" (2+2+2) fit, not more.
    "ml-team": {
        "allowed": ["medium", "large", "1g.35gb"],
        "max_slices_per_user": 2,
        "quota_compute_slices": 7,
        "server_idle_timeout": "2h",
        "kernel_idle_timeout": "1h",
        "max_session_age": "1d",
        "priority": 10,
        "default_offer": "medium",
    },
    # Heavy experiments: big slices, few of them, and time to finish. No kernel idle
    # limit: a training step may print nothing for a long while.
    "research": {
        "allowed": ["large", "full"],
        "max_slices_per_user": 1,
        "quota_slices": 2,
        "server_idle_timeout": "4h",
        "kernel_idle_timeout": None,
        "max_session_age": "3d",
        "priority": 5,
        # GPU-hour budgets (docs/policies.md, "Budgets"), in compute-slice-hours: a lease
        # of N compute slices uses N an hour while held (a whole H200, 7). Quotas cap how
        # many slices the group holds at once; a budget caps how much GPU time it takes
        # over a rolling window, so that one team cannot hold the large slices every day.
        "budget": "400h",  # the whole group per window: about 57 hours of a whole GPU
        "user_budget": "150h",  # each member's own, within the group's
        "budget_window": "7d",  # hours leave the window 7 days after they were used
        "budget_min_hold": "30m",  # a spawn must be able to run this long, else refused
        "budget_action": "stop",  # at 0 left: stop the server ("refuse_new": only refuse)
        "budget_warn_share": 0.8,  # warn members at 80 % used, and warn_before ahead
    },
    # Admins may pick anything; with the highest priority their leases are charged here
    # first, so an admin who is also an analyst does not use up the analysts' quota.
    "admins": {
        "allowed": ["small", "medium", "large", "full", "1g.35gb"],
        "max_slices_per_user": 2,
        "server_idle_timeout": "1h",
        "max_session_age": "1d",
        "priority": 100,
    },
}

# --- Everyone else ----------------------------------------------------------------------
# Users in none of the groups above get no GPU slice (None). To give them a small slice
# with a tight shared quota instead, uncomment:
# c.MIGPolicyConfig.default_policy = {
#     "allowed": ["small"],
#     "quota_slices": 2,
#     "server_idle_timeout": "20m",
#     "max_session_age": "4h",
# }
c.MIGPolicyConfig.default_policy = None
