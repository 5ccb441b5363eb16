# Whole GPUs for the few who need all of one (docs/policies.md, "Whole GPUs").
#
# A GPU with MIG off is offered whole, under the offer name "gpu", to the groups that
# list "gpu" in "allowed"; the GPUs with MIG on keep serving slices beside it. The
# server gets CUDA_VISIBLE_DEVICES=GPU-<uuid> (on Kubernetes: nvidia.com/gpu: 1 on a
# node whose device plugin runs the mixed strategy). Under quota_slices a whole GPU
# counts as one server; under quota_compute_slices as all of its compute slices (7 on
# an H200, 4 on an RTX PRO 6000).
#
# Turn MIG off on the GPUs to offer whole (nvidia-smi -i <index> -mig 0, then reset the
# GPU), and leave it on for the others. A host whose GPUs all have MIG on offers no
# whole GPU: the choice is left off the form (or greyed out with
# MIGSpawnerMixin.show_unavailable_offers).

c = get_config()  # noqa: F821 (JupyterHub's config loader provides get_config)

# The form's wording for the offer (optional; the default title is "A whole GPU").
c.MIGPolicyConfig.offers.update({
    "gpu": {
        "display_name": "Whole GPU (MIG off)",
        "description": "All of one GPU's memory and compute, for a model or a training "
                       "run that does not fit the largest slice. Measure on a slice first.",
    },
})
# A group of its own, added to those of 20-groups.py: few members, one whole GPU each,
# two at once for the group, and a firm end so that a whole GPU is not held for days.
c.MIGPolicyConfig.group_policies.update({
    "gpu-users": {
        "allowed": ["gpu"],
        "max_slices_per_user": 1,
        "quota_slices": 2,
        "server_idle_timeout": "1h",
        "max_session_age": "1d",
        "priority": 20,
    },
})
