# mig-spawner on Kubernetes (Zero to JupyterHub): one MIG slice per notebook pod.
#
# NOT loaded by default (it sits in examples/). On a z2jh hub, mount it into
# /usr/local/etc/jupyterhub/jupyterhub_config.d/ with hub.extraFiles, next to
# 20-groups.py (the group policies, unchanged on Kubernetes). Guide, Helm values, GPU
# Operator layout and RBAC: docs/kubernetes.md.
#
# Needs: the hub image with `pip install mig-spawner[kube]`, NVIDIA's GPU Operator (or
# device plugin + GPU Feature Discovery) with MIG enabled, and a ClusterRole that lets
# the hub's service account list nodes and pods (docs/kubernetes.md, "RBAC").

c = get_config()  # noqa: F821  (provided by the config loader)

# KubeSpawner with a MIG slice per pod. Every c.KubeSpawner.* setting z2jh makes (image,
# storage, resources ...) still applies: KubeMIGSpawner is a KubeSpawner.
c.JupyterHub.spawner_class = "mig_spawner.spawner.kube.KubeMIGSpawner"

# How the cluster hands out MIG devices: "device-plugin" (NVIDIA's device plugin, the
# GPU Operator's default) or "dra" (NVIDIA's DRA driver: ResourceSlices under DeviceClass
# mig.nvidia.com; pods carry a ResourceClaim). `python -m mig_spawner.kube` in the hub
# pod says which the cluster serves (docs/kubernetes.md, section 7).
c.KubeMIGSpawner.mig_resource_api = "device-plugin"

# The device plugin's MIG strategy. "auto" reads each node's nvidia.com/mig.strategy
# label (set by GPU Feature Discovery); set "mixed" or "single" to override.
#   mixed:  pods request nvidia.com/mig-<profile>: 1
#   single: pods request nvidia.com/gpu: 1 on nodes labelled
#           nvidia.com/gpu.product=<product>-MIG-<profile>
c.KubeMIGSpawner.mig_strategy = "auto"

# If your GPU nodes are tainted (common: nvidia.com/gpu:NoSchedule), GPU pods need this
# toleration. Nodes with taints the pods do not tolerate are not offered on the form.
c.KubeMIGSpawner.mig_tolerations = [
    {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
]

# Extra node labels GPU pods must match (on top of c.KubeSpawner.node_selector).
# c.KubeMIGSpawner.mig_node_selector = {"hub.jupyter.org/node-purpose": "user"}

# A GPU whose nvidia.com/gpu.product label the catalog does not know: map it to a model
# key (a100-40gb, a100-80gb, a30, h100, h100-nvl, gh200, h200, b200).
# c.KubeMIGSpawner.mig_product_models = {"NVIDIA-H200-SXM-141GB": "h200"}

# The spawn form reuses one read of the cluster's nodes and pods for this many seconds
# (claims re-read anything older than 2 s).
c.KubeMIGSpawner.mig_availability_ttl = 10.0

# Big cluster: read only the GPU nodes.
# c.KubeMIGSpawner.mig_node_label_selector = "nvidia.com/gpu.present=true"

# Leases: empty = a SQLite file beside the hub database, i.e. on the hub's PVC
# (/srv/jupyterhub). The slice service reads the same setting (c.MIGSettings, never a
# per-class one): run it as a hub-managed service in the hub pod, or use PostgreSQL.
c.MIGSettings.ledger_url = ""
