"""The data layer: the fleet view and the API-key table, as the control plane serves them over ADS."""
