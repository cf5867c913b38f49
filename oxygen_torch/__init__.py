"""oxygen_torch"""
