"""What a node gives the cluster: its cores as devices (`cores`: leases per engine, binding, the host cores the
cluster's own processes keep to) and an idle engine's cores lent to a busy one (`core_lending`). Imports nothing
from the rest of `actors`."""
