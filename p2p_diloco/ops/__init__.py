"""What operators run besides units: the bootstrap node (bootstrap_node.py), the swarm's status and dashboard
(status.py, dashboard.py), exports of a unit's checkpoint (export.py), private runs' keys and admissions
(credentials.py), and the local demo (demo.py, launcher.py)."""
