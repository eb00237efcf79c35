"""The cluster planner (`hetcomm plan`): per-device split, accumulation, precision and
memory, the predicted step and what balancing buys, from public specifications or a
calibrating profile, at any scale; and a simulation of the trainer's rebalancer.
It shares the balancer's solver and step-time model with the trainer."""

from hetcomm.plan.calibrate import RunProfile, load_run_profile
from hetcomm.plan.catalog import Catalog, Device, Link, load_catalog
from hetcomm.plan.cluster import ClusterDevice, parse_cluster
from hetcomm.plan.model_shape import PRESETS, ModelShape, parse_model
from hetcomm.plan.planner import Member, Plan, make_plan, spec_members
from hetcomm.plan.simulate import Simulation, simulate

__all__ = ["Catalog", "Device", "Link", "load_catalog", "ClusterDevice", "parse_cluster", "ModelShape", "PRESETS",
           "parse_model", "Member", "Plan", "make_plan", "spec_members", "RunProfile", "load_run_profile",
           "Simulation", "simulate"]
