mod calibration;
mod cli;
mod cost;
mod loaders;
mod lowering;
mod models;
mod planner;
mod tidy;
