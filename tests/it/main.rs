mod loaders;
mod models;
